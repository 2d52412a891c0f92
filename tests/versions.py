"""The transformers releases ringcc is tested with, each in its own folder (`make test-versions`).

Each release of RELEASES is installed with its own dependencies (4.x takes huggingface_hub
below 1.0, 5.x 1.0 or later; tokenizers and the rest as each release pins them) into
`.venv-versions/<release>/` with `pip install --target`, from wheels that the first run
downloads into `.venv-versions/wheels/<release>/`: later runs install nothing, or install
offline from those wheels. torch, ringcc and pytest stay the main environment's. Then
tests/test_versions.py (marker `versions`) runs the zoo's core there: the folder leads
PYTHONPATH, so its transformers is the one imported, by pytest and by the gloo ranks it
spawns. Each run leaves its rows in `out/versions/<release>.json`; `--matrix` writes them
into docs/compatibility.md as one column per release (tests/zoo.py: `release_table`).

    python tests/versions.py                    # every release, then the matrix
    python tests/versions.py --releases 5.17.0 --pytest-args -k llama
    python tests/versions.py --matrix           # the matrix from the rows there are, run nothing

The matrix has a column per release with rows in `out/versions/`: RELEASES, and any other
release run with `--releases` (often a subset of the architectures, with `-k`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
CACHE = os.path.join(ROOT, ".venv-versions")
ROWS = os.path.join(ROOT, "out", "versions")
# the last 4.x release line, the 5.x release whose MoE layers break the graph, the newest 5.x
RELEASES = ("4.57.1", "5.17.0", "5.24.0")
RELEASE_ENV = "RINGCC_TRANSFORMERS_RELEASE"  # the release a run expects to import (tests/test_versions.py)


def folder(release: str) -> str:
    return os.path.join(CACHE, release)


def install(release: str, python: str = sys.executable) -> str:
    """`release`'s folder, installed on first use (its wheels kept for offline reinstalls)."""
    target, wheels = folder(release), os.path.join(CACHE, "wheels", release)
    stamp = os.path.join(target, ".ringcc-installed")
    if os.path.exists(stamp):
        return target
    spec = f"transformers=={release}"
    pip = [python, "-m", "pip", "-q", "--disable-pip-version-check"]
    if not os.path.isdir(wheels) or not os.listdir(wheels):
        subprocess.run(pip + ["download", "--only-binary=:all:", "--dest", wheels, spec], check=True)
    subprocess.run(pip + ["install", "--no-index", "--find-links", wheels, "--target", target, "--upgrade", spec],
                   check=True)
    with open(stamp, "w") as f:
        f.write(spec + "\n")
    return target


def measured() -> list[str]:
    """RELEASES and every release with rows in out/versions/, oldest first."""
    from ringcc.releases import release_tuple

    rows = [f[:-len(".json")] for f in os.listdir(ROWS) if f.endswith(".json")] if os.path.isdir(ROWS) else []
    return sorted(set(RELEASES) | set(rows), key=release_tuple)


def run(release: str, pytest_args: list[str], python: str = sys.executable) -> int:
    """tests/test_versions.py under `release` (pytest's exit status)."""
    env = dict(os.environ, **{RELEASE_ENV: release}, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join([install(release, python)] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [python, "-m", "pytest", "-q", "-m", "versions", os.path.join(ROOT, "tests", "test_versions.py"),
           *pytest_args]
    print(f"transformers {release}: {' '.join(cmd[2:])}", flush=True)
    return subprocess.run(cmd, env=env, cwd=ROOT).returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--releases", nargs="*", default=list(RELEASES), help=f"default: {' '.join(RELEASES)}")
    parser.add_argument("--install-only", action="store_true", help="install the releases' folders, run nothing")
    parser.add_argument("--no-matrix", action="store_true", help="leave docs/compatibility.md as it is")
    parser.add_argument("--matrix", action="store_true",
                        help="write docs/compatibility.md's release section from the rows in out/versions/, run nothing")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed to pytest (last)")
    args = parser.parse_args(argv)
    if args.install_only:
        for release in args.releases:
            print(install(release))
        return 0
    codes = {} if args.matrix else {release: run(release, args.pytest_args) for release in args.releases}
    if args.matrix or not args.no_matrix:
        sys.path.insert(0, os.path.dirname(__file__))
        import zoo

        zoo.write_release_table(ROWS, measured())
    for release, code in codes.items():
        print(f"transformers {release}: {'passed' if code == 0 else f'pytest exit status {code}'}")
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
