"""Drafters that follow a moving target (issue 49, item 3).

- `publish`: atomic, versioned, weights-only publishing of a training run's drafter (a version
  directory in the export's own format plus `manifest.json`: version, steps, data seen), and the
  runner side's `VersionWatcher`, which turns the newest published version into a
  `draftinfer.decoding.swap.DrafterUpdate` between rounds.
- `shift`: the shifted data mix a target is fine-tuned on to make it move.
- `drift`: the drift demonstration job (`conf=online_drift`): AL over time of a stale drafter
  and an online-updated one while the target moves.
"""
