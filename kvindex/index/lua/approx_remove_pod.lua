-- remove_pod. ARGV: gen, pod. Forgets the pod (after the forget_pod fragment).
redis.call('DECRBY', P .. 'entries', forget_pod(ARGV[2]))
return 1
