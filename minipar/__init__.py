"""minipar: large-scale training techniques from scratch on torch.distributed."""
from minipar import comm
from minipar.launch import WorkerError, WorkerTimeout, launch
