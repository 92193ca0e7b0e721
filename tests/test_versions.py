from __future__ import annotations

import pytest

from raydlrm._versions import IncompatibleVersionsError, check_versions


def test_installed_pair_is_accepted() -> None:
    check_versions()


def test_matching_pair_with_local_suffix() -> None:
    check_versions(torch_version="2.13.0+cpu", fbgemm=("fbgemm-gpu-cpu", "1.8.0"))


def test_mismatched_pair_names_both_versions() -> None:
    with pytest.raises(IncompatibleVersionsError, match=r"torch 2\.13\.0 and fbgemm-gpu 1\.9\.0"):
        check_versions(torch_version="2.13.0", fbgemm=("fbgemm-gpu", "1.9.0"))


def test_unknown_torch_release() -> None:
    with pytest.raises(IncompatibleVersionsError, match="not a matching pair"):
        check_versions(torch_version="2.9.1", fbgemm=("fbgemm-gpu-cpu", "1.8.0"))
