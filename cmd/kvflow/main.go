// Command kvflow moves KV-cache blocks between prefill and decode workers.
package main

import "fmt"

func main() { fmt.Println("kvflow: not built yet") }
