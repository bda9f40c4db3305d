"""What the tests share: fake peers, process helpers, the scheduler harness (no tests here)."""
