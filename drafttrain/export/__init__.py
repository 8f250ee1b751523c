"""Shipping a drafter: the export directory (`directory`; `python -m drafttrain.export`),
its model card and the Hub upload."""
