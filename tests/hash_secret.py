"""The tests' key-hash secret (shm/keys.py), set on import.

tests/conftest.py imports it for the session. A spawned child process imports the test
module its target lives in, never conftest, so a test module whose children hash keys
imports this too. A node the tests start hashes under its own store's secret.
"""

from __future__ import annotations

from shm.keys import use_secret

SECRET = b"renderqueue-test"

use_secret(SECRET)
