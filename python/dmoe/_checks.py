"""Argument checks shared by dmoe.layer_forward/layer_backward and dmoe.MoELayer: a wrong type or range is refused
with a message naming the argument, before it reaches the extension (whose refusal of a wrong scalar type is
nanobind's "incompatible function arguments" listing the whole signature)."""

from __future__ import annotations

import math
import numbers

INT32_MAX = 2**31 - 1


def check_int(where, name, v, lo=1, hi=INT32_MAX):
    """An int (Python or numpy; not bool) in [lo, hi]; returned as a Python int."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{where}: {name} = {v!r} is a {type(v).__name__}; must be an int")
    v = int(v)
    if not lo <= v <= hi:
        raise ValueError(f"{where}: {name} = {v} is invalid; must be an int in [{lo}, {hi}]")
    return v


def check_float(where, name, v, allowed="a finite number >= 0"):
    """A real number (int or float, Python or numpy; not bool), finite and >= 0; returned as a float."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{where}: {name} = {v!r} is a {type(v).__name__}; must be {allowed}")
    v = float(v)
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{where}: {name} = {v} is invalid; must be {allowed}")
    return v


def check_bool(where, name, v):
    """True or False (numpy's bool too)."""
    if type(v).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{where}: {name} = {v!r} is a {type(v).__name__}; must be True or False")
    return bool(v)


def check_choice(where, name, v, allowed):
    if not isinstance(v, str) or v not in allowed:
        shown = f"'{v}'" if isinstance(v, str) else f"{v!r} (a {type(v).__name__})"
        raise ValueError(f"{where}: {name} {shown} is unknown; allowed: {', '.join(allowed)}")
    return v
