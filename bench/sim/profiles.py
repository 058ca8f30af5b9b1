"""Engine profiles for the simulators: shipped in ``engines/profiles`` (see
:mod:`engines.profile_store`), or any profile JSON by path."""

from engines.profile_store import PROFILE_DIR, load_profile, shipped_profiles

__all__ = ["PROFILE_DIR", "load_profile", "shipped_profiles"]
