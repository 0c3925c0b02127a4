"""What both providers of this package share, each module one thing; a provider imports down into it, never across."""
