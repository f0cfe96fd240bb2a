//! Tests of the payment resource's and the rail proxy's audit identity, envelope gaps, retention and ABANDONED (issue 13 items 13, 15, 16).
