"""Backward engines: the Engine interface and the sequential reference engine."""

from pargrad.engine.base import (
    Engine,
    current_engine,
    get_default_engine,
    set_default_engine,
    use_engine,
)
from pargrad.engine.sequential import SequentialEngine

__all__ = [
    "Engine", "SequentialEngine", "current_engine", "get_default_engine",
    "set_default_engine", "use_engine",
]
