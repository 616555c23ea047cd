"""`python -m radixserve ...` runs the `radixserve` command."""

from radixserve.cli import main

raise SystemExit(main())
