"""The stderr console every command renders progress and logs on (stdout stays for results)."""
from rich.console import Console

err_console = Console(stderr=True)
