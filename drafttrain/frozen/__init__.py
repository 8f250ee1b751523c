"""The frozen target of training: features captured with hooks (`target`: `FrozenTarget`) and
its distribution computed only where a loss needs it (`head`)."""
