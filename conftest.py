"""Set-up shared by tests/ and tests_dist/ (pytest loads this rootdir conftest for both)."""

import os
import sys

# DeepSpeed JIT-builds its CPU comm op with the first `ninja` on PATH; the virtual environment's and the
# system's differ in version and each switch rebuilds the op (~30 s a time), so every test and every worker it
# launches (they inherit PATH) takes the interpreter's own tools first, as the README's `. .venv/bin/activate` does.
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join([_BIN, os.environ.get("PATH", "")])
