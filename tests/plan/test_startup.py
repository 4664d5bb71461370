"""A plan builds its models on meta and draws no weights, so it never imports torch._dynamo
(1.5 s of its start), which torch's ``normal_`` on a meta tensor does."""

import subprocess
import sys

PLAN = (
    "import io, sys\n"
    "from rich.console import Console\n"
    "from parallax.plan.cli import plan\n"
    "argv = ['--gpus', '1', '--gpu-memory', '140']\n"
    "result, _ = plan(argv, Console(file=io.StringIO()))\n"
    "print(bool(result.ranked), 'torch._dynamo' in sys.modules)\n"
)


def test_a_plan_does_not_import_the_compiler():
    done = subprocess.run([sys.executable, "-c", PLAN], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr[-3000:]
