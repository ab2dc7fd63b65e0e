from oracle.tools.cli import main

raise SystemExit(main())
