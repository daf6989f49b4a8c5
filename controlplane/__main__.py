"""``python -m controlplane`` runs ``elasticctl``."""

from controlplane.cli import main

main()
