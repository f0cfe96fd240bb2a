//! Tests of TokenReview bounds, what errors and --help never show, and envelope gaps (issue 13 items 12, 14, 15).
