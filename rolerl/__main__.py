from rolerl.cli import main

raise SystemExit(main())
