from rlbus.monitors.service import main

main()
