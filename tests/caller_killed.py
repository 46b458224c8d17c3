"""Starts a job whose workers sleep; the test SIGKILLs this process and checks the workers go too."""
import sys

import workers_launch

import minipar

if __name__ == "__main__":
    minipar.launch(workers_launch.hang_on, 2, 0, sys.argv[1], timeout=120)
