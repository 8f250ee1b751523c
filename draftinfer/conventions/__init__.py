"""The conventions training and serving share (DESIGN section 3), one definition each:
pairing and positions, the drafter's input window, `Slots` (cache index apart from RoPE
position), the draft vocabulary and acceptance length."""
