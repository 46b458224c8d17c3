import os
import sys
import tempfile

# Worker functions live in modules under tests/ (tests/ is not a package); put tests/ on sys.path so
# they import by name here and in the worker processes that minipar.launch starts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The CPU's measured matmul peak (MFU's denominator) is cached under XDG_CACHE_HOME: a run of the
# tests measures its own, in a folder of its own, rather than reuse (or overwrite) the user's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="minipar-test-cache-")
