from p2pdiloco.cli import main

raise SystemExit(main())
