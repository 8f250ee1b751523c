"""The frozen target of training: features captured with hooks (`frozen`) and its
distribution computed only where a loss needs it (`head`)."""
