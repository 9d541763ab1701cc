"""schemathesis, with every check and every phase, against a live node on each backend:
requests drawn from `/openapi.json` (valid ones, and ones broken on purpose) are answered
as the document says, and none with a 5xx other than the 503s it states.

What JSON Schema cannot say for the fuzzer (a key's UTF-8 bytes, the sitemap body, the
long poll) is in tests/contract_hooks.py; 413 counted as a refusal, in
tests/schemathesis.toml. RENDERQUEUE_FUZZ_SEED picks another seed (the default keeps CI
repeatable), RENDERQUEUE_FUZZ_EXAMPLES more cases.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from node_harness import ADMIN_TOKEN, REPO, api_settings_for, node_db, seed_rows, thread_node

from api.endpoints import ENDPOINTS

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

TESTS = Path(__file__).resolve().parent
SEED = os.environ.get("RENDERQUEUE_FUZZ_SEED", "19")
EXAMPLES = os.environ.get("RENDERQUEUE_FUZZ_EXAMPLES", "80")
PHASES = "examples,coverage,fuzzing,stateful"
# The production body limit: the document states it and the fuzzer's bodies meet it.
BODY_LIMIT = api_settings_for().max_body_bytes


def schemathesis(url: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    command = [
        str(Path(sys.executable).parent / "schemathesis"),
        "--config-file",
        str(TESTS / "schemathesis.toml"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--phases",
        PHASES,
        "--max-examples",
        EXAMPLES,
        "--seed",
        SEED,
        "--header",
        f"Authorization: Bearer {ADMIN_TOKEN}",
        "--output-truncate",
        "true",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)])}
    return subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=840, check=False
    )


# A hang guard above the suite's (pyproject): the fuzzer's run is the longest single test,
# and a loaded machine stretches it. Its subprocess has a guard of its own, just inside.
@pytest.mark.timeout(900)
def test_schemathesis_finds_no_disagreement(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 20)
    with thread_node(tmp_path, tokens=True, max_body_bytes=BODY_LIMIT) as node:
        node.wait_published()
        run = schemathesis(node.url, tmp_path)
    output = run.stdout + run.stderr
    summary = "\n".join(output.splitlines()[-40:])
    assert run.returncode == 0, f"schemathesis failed (seed {SEED}):\n{output[-12000:]}"
    # It ran what it was asked to: every operation, every phase, a real number of cases.
    selected = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", output)
    assert selected, summary
    assert len(set(selected.groups())) == 1 and int(selected.group(1)) >= len(ENDPOINTS), summary
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅ {phase}", output), f"{phase} did not pass:\n{summary}"
    cases = re.search(r"(\d+) generated, (\d+) passed", output)
    assert cases and int(cases.group(1)) == int(cases.group(2)) >= 500, summary
    print(f"schemathesis, seed {SEED}: {cases.group(0)}")
