"""The TensorFlow + Keras range: written once in pyproject.toml, refused outside it at import, tested in pairs."""

import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.specifiers import SpecifierSet

from gpupar import versions

from conftest import ROOT

RANGES = {"tensorflow": SpecifierSet(">=2.18,<2.22"), "keras": SpecifierSet(">=3.8,<3.16")}


def _pyproject_ranges():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    return {name: SpecifierSet(spec) for name, spec in (re.match(r"([a-z_-]+)(.*)", d).groups() for d in dependencies)
            if name in versions.DISTRIBUTIONS}


def _version_pairs():
    with open(os.path.join(ROOT, "Makefile")) as f:
        return [pair.split(":") for pair in re.search(r"^VERSION_PAIRS := (.*)$", f.read(), re.M)[1].split()]


def test_the_installed_requirements_are_pyprojects_range():
    assert versions.declared_ranges() == _pyproject_ranges()


def test_every_pair_that_ci_tests_is_in_the_range_and_the_newest_is_this_environments():
    ranges = _pyproject_ranges()
    pairs = _version_pairs()
    for tf_version, keras_version in pairs:
        assert versions.refusal(ranges, {"tensorflow": [("tensorflow", tf_version)],
                                         "keras": [("keras", keras_version)]}) is None, (tf_version, keras_version)
    if os.path.basename(os.path.dirname(os.path.dirname(sys.executable))) == ".venv":  # make venv's, not a pair's
        assert pairs[-1] == [metadata.version("tensorflow"), metadata.version("keras")]


@pytest.mark.parametrize("tf_name, tf_version, keras_version", [
    ("tensorflow", "2.18.0", "3.8.0"),
    ("tensorflow", "2.21.0", "3.15.1"),
    ("tensorflow-cpu", "2.19.1", "3.10.0"),
    ("tensorflow", "2.21.0rc1", "3.12.0"),  # a release candidate inside the range
    ("tensorflow", "2.19.0+nv25.02", "3.10.0"),  # NVIDIA's containers' local version: its public part counts
])
def test_versions_in_the_range_pass(tf_name, tf_version, keras_version):
    found = {"tensorflow": [(tf_name, tf_version)], "keras": [("keras", keras_version)]}
    assert versions.refusal(RANGES, found) is None


@pytest.mark.parametrize("found, named", [
    ({"tensorflow": [("tensorflow", "2.17.1")], "keras": [("keras", "3.8.0")]}, "tensorflow 2.17.1"),
    ({"tensorflow": [("tensorflow", "2.22.0")], "keras": [("keras", "3.15.1")]}, "tensorflow 2.22.0"),
    ({"tensorflow": [("tensorflow", "2.21.0")], "keras": [("keras", "3.7.0")]}, "keras 3.7.0"),
    ({"tensorflow": [("tf-nightly", "2.22.0.dev20260101")], "keras": [("keras-nightly", "3.16.0.dev2026010103")]},
     "tf-nightly 2.22.0.dev20260101, keras-nightly 3.16.0.dev2026010103"),
    ({"tensorflow": [("tensorflow", "2.21.0"), ("tensorflow-cpu", "2.16.2")], "keras": [("keras", "3.15.1")]},
     "tensorflow-cpu 2.16.2"),  # both installed: their files are mixed, so both must be in the range
])
def test_a_version_outside_the_range_is_refused_in_one_line_naming_the_range(found, named):
    message = versions.refusal(RANGES, found)
    assert message == (f"gpupar supports tensorflow>=2.18,<2.22 with keras>=3.8,<3.16, but this environment has "
                       f"{named}: pip install 'tensorflow>=2.18,<2.22' 'keras>=3.8,<3.16'")


def test_no_tensorflow_distribution_is_not_refused_here():
    """A TensorFlow without metadata (built from source) cannot be checked; one missing fails its own import."""
    assert versions.refusal(RANGES, {"tensorflow": [], "keras": [("keras", "3.15.1")]}) is None


def test_check_supported_reads_the_installed_versions(monkeypatch):
    fake = {"gpupar": None, "tensorflow": "2.17.1", "keras": "3.15.1"}

    def version(name):
        if name not in fake:
            raise metadata.PackageNotFoundError(name)
        return fake[name]

    monkeypatch.setattr(versions.metadata, "version", version)
    monkeypatch.setattr(versions.metadata, "requires", lambda name: ["tensorflow<2.22,>=2.18", "keras<3.16,>=3.8",
                                                                     'pytest>=7; extra == "test"'])
    with pytest.raises(ImportError, match=r"^gpupar supports tensorflow>=2\.18,<2\.22 with keras>=3\.8,<3\.16, but "
                                          r"this environment has tensorflow 2\.17\.1: pip install"):
        versions.check_supported()
    fake["tensorflow"] = "2.21.0"
    versions.check_supported()


def _import_gpupar(tmp_path, code, fake_tensorflow=None):
    """Runs code after `import gpupar` in a fresh Python, with a fake tensorflow distribution first on the path."""
    path = [os.environ.get("PYTHONPATH", "")]
    if fake_tensorflow:
        info = tmp_path / f"tensorflow-{fake_tensorflow}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tensorflow\nVersion: {fake_tensorflow}\n")
        path.insert(0, str(tmp_path))
    return subprocess.run([sys.executable, "-c", f"import gpupar\n{code}"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}, timeout=120)


def test_import_gpupar_checks_without_importing_tensorflow(tmp_path):
    run = _import_gpupar(tmp_path, "import sys; print(sorted({'tensorflow', 'keras'} & set(sys.modules)))")
    assert run.returncode == 0, run.stderr
    assert run.stdout == "[]\n"


def test_import_gpupar_refuses_a_tensorflow_outside_the_range(tmp_path):
    run = _import_gpupar(tmp_path, "", fake_tensorflow="2.17.1")
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1].startswith(
        "ImportError: gpupar supports tensorflow>=2.18,<2.22 with keras>=3.8,<3.16, but this environment has "
        "tensorflow 2.17.1: pip install")
