"""The releases qgraph was tested with, and the check ``import qgraph`` runs against them."""
from __future__ import annotations

import re
import warnings
from importlib import metadata

# The releases the tests ran on: (floor, newest tested), as major.minor. Below the floor qgraph
# does not import (an ImportError names the floor); past the newest it imports with a warning.
# transformers' floor is 5.9 (TransformerLens 4's): 5.2 to 5.8 compute the ViT's position embeddings
# from the image grids with Python loops that export cannot follow. torch's floor is 2.10; older
# releases are not tested. What differs inside the ranges: docs/versions.md.
TESTED = {"torch": ("2.10", "2.14"), "transformers": ("5.9", "5.25")}


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("2.14.1+cu130" -> (2, 14, 1))."""
    leading = re.match(r"[\d.]*", version).group()  # type: ignore[union-attr]  # [\d.]* matches every string
    return tuple(int(part) for part in re.findall(r"\d+", leading))


def check_versions() -> None:
    """Raise ImportError naming the floor if torch or transformers is older than the tested range;
    warn (one line naming the tested ranges) if either is newer."""
    ranges = ", ".join(f"{package} {low}-{high}" for package, (low, high) in TESTED.items())
    for package, (low, high) in TESTED.items():
        installed = metadata.version(package)
        release = _release(installed)
        if release[:2] < _release(low):
            raise ImportError(f"qgraph needs {package} >= {low} (it uses {package} internals listed in "
                              f"qgraph/compat/); {installed} is installed: pip install '{package}>={low}'")
        if release[:2] > _release(high):
            warnings.warn(f"qgraph was tested with {ranges}; {package} {installed} is newer and untested",
                          UserWarning, stacklevel=2)
