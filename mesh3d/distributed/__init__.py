"""Process-group plumbing every part uses: agreeing on errors across ranks, torchrun's store,
naming a peer that stopped answering, and the local view of a DTensor."""
