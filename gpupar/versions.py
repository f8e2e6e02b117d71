"""The TensorFlow and Keras versions gpupar supports, checked at `import gpupar` without importing either.

The range is written once, in pyproject.toml's dependencies; this reads it back from the installed
distribution's requirements (importlib.metadata.requires("gpupar")) and compares the installed versions with it.
"""

import re
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

# The distributions that install each module, all held to the module's range: tensorflow-cpu and Windows'
# tensorflow-intel are TensorFlow's own builds under other names, the nightlies are refused by their version
# (2.22.0.devN is past <2.22). Where several are installed, their files are mixed: each must be in the range.
DISTRIBUTIONS = {
    "tensorflow": ("tensorflow", "tensorflow-cpu", "tensorflow-intel", "tf-nightly", "tf-nightly-cpu"),
    "keras": ("keras", "keras-nightly"),
}

# A requirement without a marker (the extras' have one): its name, then its version specifier.
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)$")


def declared_ranges(distribution: str = "gpupar") -> dict[str, SpecifierSet]:
    """{module: range} of tensorflow and keras in the installed distribution's requirements; {} if not installed."""
    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed: nothing declared
        return {}
    ranges = {}
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match and match[1].lower() in DISTRIBUTIONS:
            ranges[match[1].lower()] = SpecifierSet(match[2])
    return ranges


def installed_versions(module: str) -> list[tuple[str, str]]:
    """(distribution, version) of each installed distribution that provides the module."""
    found = []
    for name in DISTRIBUTIONS[module]:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    return found


def range_text(specifier: SpecifierSet) -> str:
    """The range as pyproject writes it: lower bounds first (">=2.18,<2.22")."""
    return ",".join(sorted(map(str, specifier), key=lambda clause: not clause.startswith(">")))


def refusal(ranges: dict[str, SpecifierSet], found: dict[str, list[tuple[str, str]]]) -> str | None:
    """The one-line refusal of these installed versions, or None when every one is in its module's range.

    A module with no installed distribution is not refused here: its own import will say so, and a build
    without metadata cannot be checked. Pre-releases inside the range are accepted (2.21.0rc1), and local
    versions are compared by their public part (NVIDIA's 2.19.0+nv25.02 as 2.19.0).
    """
    outside = [f"{name} {version}" for module, specifier in ranges.items() for name, version in found.get(module, ())
               if not _inside(specifier, version)]
    if not outside:
        return None
    wanted = [f"{module}{range_text(specifier)}" for module, specifier in ranges.items()]
    return (f"gpupar supports {' with '.join(wanted)}, but this environment has {', '.join(outside)}: "
            f"pip install {' '.join(repr(w) for w in wanted)}")


def _inside(specifier: SpecifierSet, version: str) -> bool:
    try:
        return specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:  # not a version pip could have compared with the range either
        return False


def check_supported(distribution: str = "gpupar") -> None:
    """Raises ImportError, in one line, when an installed TensorFlow or Keras is outside the declared range."""
    ranges = declared_ranges(distribution)
    message = refusal(ranges, {module: installed_versions(module) for module in ranges})
    if message:
        raise ImportError(message)
