"""dearcomm in the training frameworks people already use. Each integration
is its own optional extra and is imported only when you import it:

    from dearcomm.integrations.lightning import DearStrategy   # pip install 'dearcomm[lightning]'
    from dearcomm.integrations import accelerate                # pip install 'dearcomm[accelerate]'

``import dearcomm`` imports neither framework.
"""
