"""The runnable snippets of README.md and docs/EXCHANGE.md run, as written, on 2 real Horovod ranks (Gloo)."""
import re
from pathlib import Path

import pytest

from launch import ROOT, run_horovod

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


def test_exchange_doc_snippets_run(tmp_path):
    blocks = []
    for doc, least in ((Path(ROOT) / "README.md", 1), (Path(ROOT) / "docs" / "EXCHANGE.md", 2)):
        found = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
        assert len(found) >= least, doc
        blocks += found
    script = tmp_path / "snippets.py"
    # Each block is a complete program; run them one after the other in one job.
    script.write_text("\n\n".join(f"def block_{i}():\n" + "".join(f"    {line}\n" for line in b.splitlines())
                                  for i, b in enumerate(blocks))
                      + "\n\n" + "".join(f"block_{i}()\n" for i in range(len(blocks)))
                      + "print('SNIPPETS OK', flush=True)\n")
    result = run_horovod(script, np=2, controller="gloo", timeout=240)
    assert result.stdout.count("SNIPPETS OK") == 2, result.stdout[-3000:]
    assert "'ratio'" in result.stdout
