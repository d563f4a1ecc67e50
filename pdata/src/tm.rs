//! The transaction manager (filled in next).
