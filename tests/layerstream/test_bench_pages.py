"""layerstream.bench.pages runs its three copies of the same weights and says how each is paged; its files go."""

from __future__ import annotations

import re

import pytest

from engine.kernels import int4_backend
from layerstream.bench import pages
from tests.support.large_folios import no_large_folios


def test_three_copies_timed_and_the_scattered_file_is_in_small_pages(tmp_path, capsys):
    if int4_backend() != "vnni":
        pytest.skip("bench-pages times the VNNI int4 kernel")
    assert pages.main(["--mib", "24", "--rounds", "2", "--threads", "1", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {m[0]: m[1:] for m in re.findall(r"^(file, 4 KiB scattered|file, huge folios|anonymous memory)\s+"
                                            r"([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)x", out, re.M)}
    assert rows.keys() == {"file, 4 KiB scattered", "file, huge folios", "anonymous memory"}, out
    assert all(float(ms) > 0 for ms, _, _ in rows.values())
    assert re.search(r"^file, 4 KiB scattered .*  0% of \d+ MiB mapped in huge pages$", out, re.M), out
    if not no_large_folios(tmp_path):  # the chunked, hinted copy is mapped in huge pages where the kernel can
        share = re.search(r"^file, huge folios .*  (\d+)% of \d+ MiB mapped in huge pages$", out, re.M)
        assert share and int(share[1]) >= 50, out
    assert "memory read probe" in out
    assert list(tmp_path.iterdir()) == []  # the two files were removed
