import os
import sys

# Worker functions live in modules under tests/ (tests/ is not a package); put tests/ on sys.path so
# they import by name here and in the worker processes that minipar.launch starts.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
