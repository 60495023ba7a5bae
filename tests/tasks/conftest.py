import sys
from pathlib import Path

# The training tests' data helpers (train_data, seg_data) serve these tests too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
