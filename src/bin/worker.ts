/** The worker process entry (spawned by the WorkerPool with a private pipe on fd 3). */
import { main } from "../Worker.js"

main()
