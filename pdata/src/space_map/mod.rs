//! Space maps: reference counts of blocks (filled in next).
