"""Feature sources training reads instead of running the target (`registry`): the project's
own stored features (`stored`) and what serving engines extract (`engine`)."""

from drafttrain.sources import engine, stored  # noqa: F401  (register on import)
from drafttrain.sources.registry import SOURCES, FeatureSource, register_source, selected_source

__all__ = ["SOURCES", "FeatureSource", "register_source", "selected_source"]
