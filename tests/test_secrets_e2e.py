"""A profiled script with secrets planted in every form: none reaches any file in the output folder, nor
memdoctor's terminal output (issue 19, point 5). One ``memdoctor profile`` run in a child process."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV_TOKEN = "PlantedEnvOnlyToken-7c1d2e"  # no known shape: found only as the environment's value
HF = "hf_" + "PlantedHuggingFaceToken1234567"
SECRETS = {
    "--db-pass": "planted-db-pass",
    "--auth": "planted-auth",
    "--credentials": "planted-creds",
    "--pat": "planted-pat",
    "--bearer": "planted-bearer",
}
URL_PASSWORD = "planted-url-password"

SCRIPT = f"""
import os, sys
import torch
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 1:
        raise RuntimeError("login failed for " + os.environ["MY_SERVICE_TOKEN"] + " and " + {HF!r})
"""


def test_planted_secrets_reach_no_output_and_no_terminal_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    args = [part for flag, value in SECRETS.items() for part in (flag, value)]
    args += ["--data", f"https://user:{URL_PASSWORD}@example.com/d", HF, "--lr", "0.1"]
    env = dict(os.environ, MY_SERVICE_TOKEN=ENV_TOKEN, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "memdoctor", "profile", "--warmup", "1", "--steps", "3", "-o", str(out)]
    proc = subprocess.run(
        [*cmd, "--budget", "1GiB", str(script), "--", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, proc.stderr  # the script raised
    texts = {"terminal": proc.stdout + proc.stderr}
    for path in out.iterdir():
        data = path.read_bytes()
        texts[path.name] = (gzip.decompress(data) if path.name.endswith(".gz") else data).decode()
    assert {"trace.jsonl.gz", "summary.json", "report.html"} <= set(texts)
    planted = [*SECRETS.values(), URL_PASSWORD, HF, ENV_TOKEN]
    for name, text in texts.items():
        for secret in planted:
            assert secret not in text, f"{secret} reached {name}"
    assert "login failed for <redacted>" in texts["trace.jsonl.gz"]
    assert "--db-pass" in texts["trace.jsonl.gz"] and "--lr" in texts["summary.json"] + texts["report.html"]
