"""Shared stand-ins for the trainer's pure-logic tests."""

from __future__ import annotations

import types


class Remote:
    """`actor.method.remote(...)` over an in-process object (pure logic tests only)."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=getattr(self._obj, name))
