"""What more than one test file uses: each module named for the test file it came from (common: conftest's)."""
