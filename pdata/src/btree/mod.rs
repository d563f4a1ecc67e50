//! Copy-on-write B-trees in dm's node format (filled in next).
