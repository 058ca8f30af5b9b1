"""Engine profiles by name or path: the one folder of shipped profiles (``engines/profiles``).

It holds the papers' modelled profiles (``a6000_llama31_8b``, ``v100_llama32_3b``, each with
a ``.md`` of its derivation) and those measured here by ``pdserve profile``
(``cpu2core_vllm032_*``). The plug-ins (this layer) and the simulators (``bench``, above it)
resolve names through this module, so neither layer reaches up for its data.
"""

from __future__ import annotations

from pathlib import Path

from controllers.profile import EngineProfile

PROFILE_DIR = Path(__file__).parent / "profiles"


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A shipped profile by name (e.g. ``a6000_llama31_8b``) or a profile JSON by path."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return EngineProfile.load(path)
    shipped = PROFILE_DIR / f"{name_or_path}.json"
    if shipped.exists():
        return EngineProfile.load(shipped)
    raise FileNotFoundError(
        f"no engine profile {str(name_or_path)!r}: not a JSON file, and not one of the shipped "
        f"profiles {shipped_profiles()}"
    )
