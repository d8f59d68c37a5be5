from rlbus_launch.monitor.service import main

main()
