"""Byte units, in one place: binary, as torch and /proc count memory."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20
