"""What training optimizes: the per-draft losses and their weights, the fused linear +
soft cross-entropy, per-position scoring and training-time-test attention."""
