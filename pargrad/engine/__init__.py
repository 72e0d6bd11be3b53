"""Backward engines: the Engine interface, the sequential reference engine and the
threaded engine."""

from pargrad.engine.base import BackwardRequest, Engine, use_engine
from pargrad.engine.selection import current_engine, get_default_engine, set_default_engine
from pargrad.engine.sequential import SequentialEngine
from pargrad.engine.threaded import ThreadedEngine

__all__ = [
    "BackwardRequest", "Engine", "SequentialEngine", "ThreadedEngine", "current_engine",
    "get_default_engine", "set_default_engine", "use_engine",
]
