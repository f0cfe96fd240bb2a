//! Tests of the lock server's waiter queue, its audit identity and its retention (issue 13 items 11, 13, 16).
