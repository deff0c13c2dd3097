"""`python -m whalezen ...` is the `whalezen` command."""
from whalezen.cli import entry

entry()
