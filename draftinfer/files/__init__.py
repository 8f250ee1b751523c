"""Files in and out: the exported-drafter contract (`checkpoint`), target checkpoints on disk
and their loading, shipped package data (`paths`: presets, the zoo), strict field reading,
and the one-line errors bad input raises."""
