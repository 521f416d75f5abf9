"""unirl-fsdp: the UniRL actor scaled out over a group of Ray actors with PyTorch FSDP2.

Nothing heavy is imported here: the kernel lists this plugin without importing torch or Ray.
The actor itself is :class:`unirl_fsdp.actor.FSDPActor`.
"""

__version__ = "0.1.0"
