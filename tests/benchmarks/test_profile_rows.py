"""benchmarks/tools/profile_rows.py runs both rows on the CPU (tiny models; no GPU kernels
there)."""

from benchmarks.tools.profile_rows import main


def test_lora_and_siglip_rows(tmp_path):
    text = main(["--out", str(tmp_path / "l.txt"), "lora", "--smoke", "--batch", "2"])
    assert text.startswith("lora --smoke --batch 2: step ") and "no GPU kernels" in text
    assert (tmp_path / "l.txt").read_text().startswith("lora --smoke")
    text = main(["--out", str(tmp_path / "s.txt"), "siglip", "torch", "4", "--smoke"])
    assert text.startswith("siglip torch batch 4: step ") and "by kind" in text


def test_a_planner_row(tmp_path):
    text = main(["--out", str(tmp_path / "p.txt"), "plan", "tiny", "--smoke"])
    assert text.startswith("plan tiny (tp1 pp1 dp1") and "predicted" in text and "by kind" in text
